"""The memory model, the planner and the device estimate."""
