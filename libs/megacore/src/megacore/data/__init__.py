"""Token data: Megatron `MMIDIDX` shards (`indexed`), written by mega-tokenize, and what mega-train
reads from them: a tokens artifact's documents (`documents`), document splits and per-epoch GPT
samples (`samples`), deterministic blending of sources (`blend`) and the cached facade (`dataset`)."""

from megacore.data.indexed import IndexedReader, IndexedWriter, token_dtype

__all__ = ["IndexedReader", "IndexedWriter", "token_dtype"]
