"""Plan execution: the persistent input batch, the one plan consumer, the runners, the
sampler and the paged KV cache with its swap copies."""
