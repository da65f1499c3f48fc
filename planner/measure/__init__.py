"""What `lamina profile` measures (planner/profile.py), each in its own module: the
engine's kernels and the machine's memory (`kernels`), a transport's ping-pong
(`pingpong`), the local engine's decode step (`engine_step`) and a small decode through
the stack (`stack_run`). The benchmarks in bench/ time the same things with these
functions, so a profile and a benchmark measure alike.

They import torch (and `stack_run` the services); the planner's models never do.
"""
