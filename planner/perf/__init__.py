"""Performance models, one pure module each. Times are seconds, sizes bytes, rates
bytes/s or FLOP/s; every function takes shapes, devices and counts and returns numbers."""
