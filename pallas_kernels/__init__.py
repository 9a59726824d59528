"""Pallas kernels (GPU). Each module holds one kernel family: body, launcher, tuning table."""
