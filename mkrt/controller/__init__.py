"""SM-partition control: how a fused kernel's CTAs are split between roles (compute /
communication), and whether fusing pays.

* :mod:`mkrt.controller.board`: the host side of a persistent kernel's role board (its task
  queues, the split, what the controller learned, the trace); the device side, CTAs drawing
  tasks from the queues and changing role between tasks, is mkrt/kernels/device/roles.py.
* :mod:`mkrt.controller.rule`: the controller's rule in Python (balance the roles' measured
  rates, damped, remembered per op and shape), exactly what the device runs, tested on
  simulated and recorded signal traces.
* :mod:`mkrt.controller.cost`: the static role-split rule the controller starts from and the
  fitted fused-or-unfused rule.
"""
