"""Token data: Megatron `MMIDIDX` shards (`indexed`), read by mega-train, written by mega-tokenize."""

from megacore.data.indexed import IndexedReader, IndexedWriter, token_dtype

__all__ = ["IndexedReader", "IndexedWriter", "token_dtype"]
