"""The cache, in pure torch: `KVCache` (the transformers `Cache` users pass), its layers' slots, the steady decode
step, the attention function that joins `cache.update` to the layer, int8 storage and KVzip's reconstruction pass
(reconstruct.py). It asks `h2o_kv.backends` for the kernels a device runs. Nothing is imported here:
`h2o_kv.cache.formats` stays light for flag parsing."""
