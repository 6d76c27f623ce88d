"""tsspec: speculative decoding for GGUF language models.

Three layers stay apart: the target (trunk model, ``tsspec.models``), the speculator
(algorithm, ``tsspec.spec``) and the draft weights (thin adapters over trained drafters).
"""

__version__ = "0.1.0"
