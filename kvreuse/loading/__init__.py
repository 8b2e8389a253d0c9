"""Files to a model: a folder's or a GGUF file's weights, config and tokenizer, found, checked and loaded into
kvreuse.models' architectures (loader.py), the GGUF reader (gguf.py), and the digests that name what was
loaded (digest.py) for the cache's keys.
"""

from kvreuse.loading.loader import load_model, resolve_dtype, resolve_model_path

__all__ = ["load_model", "resolve_dtype", "resolve_model_path"]
