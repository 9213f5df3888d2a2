"""SM-partition control: how a fused kernel's CTAs are split between roles (compute /
intra / inter / reduce), and whether fusing pays.

Today: the static role-split rule and the fitted fused-or-unfused rule
(:mod:`mkrt.controller.cost`). The on-GPU controller that moves CTAs between roles at run
time is not built yet: ops take their role split as a runtime argument until it lands.
"""
