"""Native code and its thin op bindings: no model, batch or cache knowledge.

Each module binds one C++ library of ``csrc/`` (built for this CPU at first use by ``build.py``, cached by a
digest of source, flags, torch and CPU flags) and says what it computes:

- ``rowdot.py``: the float GEMV for decode rows; ``quant_ops.py``: products and dequantizing over quantized
  blocks (GGUF's formats, ``quant.py``'s layouts); ``qpacked.py``: the packed int8 kernel batch-invariant
  mode runs; ``fused_ops.py``: norm, rotary, activation and argmax in one pass;
- ``paged_attention.py``: attention read in place from the paged pool (the backend that runs it is
  attention/cpu_paged.py); ``kv_codec.py``: the quantized KV pool's write and gather (cache/kv.py calls it);
- ``decoder_layer.py`` and ``moe.py``: a decode step's layers and a MoE layer's experts in one call each;
- ``triton_attention.py``: the Triton kernels of the CUDA paged attention backend;
- ``cpu.py``: the CPU's flags, and whether bfloat16 is fast here.

Which kernel a layer runs is the layers' choice (layers/plan_book.py), never a binding's.
"""
