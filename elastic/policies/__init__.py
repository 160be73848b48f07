"""Pure decision functions: observation + config + clock in, (decision, reason) out.

Policies never touch Ray or read the clock; the controller passes `now` in,
and tests pass a fake one.
"""
