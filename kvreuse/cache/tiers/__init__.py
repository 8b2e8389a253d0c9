"""KV tiers behind the device pool: host memory, disk, Redis (see store.py)."""
