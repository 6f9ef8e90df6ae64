"""``megatron-cg tune``: which CUDA-graph setup to train a model with (docs/tune.md). ``candidates`` and
``ranking`` are pure; ``command`` checks and predicts on CPU and ``timing`` / ``trainer`` time on the GPU."""
