"""Speculative decoding: EAGLE drafts that live in the target's KV blocks, drafting, verification, distillation."""
