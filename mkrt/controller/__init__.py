"""On-GPU SM-partition controller (roles: compute / intra / inter / reduce).

Not built yet: ops take their role split as a runtime argument until it lands.
"""
