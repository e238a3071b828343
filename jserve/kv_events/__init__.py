"""Layer: KV-cache events. The records the prefix cache logs as it changes (`records`, pure
Python: the block manager emits them) and their publisher in vLLM's KV-events wire format over
ZMQ (`publisher`), for KV-aware routers."""
