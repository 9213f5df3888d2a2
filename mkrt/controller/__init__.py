"""SM-partition control: how a fused kernel's CTAs are split between roles (compute /
intra / inter / reduce), and whether fusing pays.

Today: the static role-split rule and the fitted fused-or-unfused rule
(:mod:`mkrt.controller.cost`), and the adaptive rule the on-GPU controller will run
(:mod:`mkrt.controller.rule`: balance the roles' measured rates, damped, remembered per op
and shape; tested on simulated calls in tests/test_controller_rule.py). The device side
(CTAs drawing tasks from role queues and changing role at task boundaries) is not built
yet: ops take their role split as a runtime argument until it lands; the static splits it
will be judged against are swept by experiments/controller.py.
"""
