"""The cache, in pure torch: `KVCache` (the transformers `Cache` users pass), its layers' slots, the steady decode
step, the attention function that joins `cache.update` to the layer, and int8 storage. It asks `h2o_kv.backends`
for the kernels a device runs. Nothing is imported here: `h2o_kv.cache.formats` stays light for flag parsing."""
