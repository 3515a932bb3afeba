"""Language-model data: an embedded default corpus (no download), text files, local HF datasets.

:class:`TextDataModule` turns a :class:`Corpus` into fixed-length next-token batches through a
:class:`Tokenizer` (bytes by default, vocabulary 256) and a token cache outside the repository::

    dm = TextDataModule(seq_len=128, batch_size=8)                       # the stdlib's sources
    dm = TextDataModule(corpus=TextFileCorpus(paths="books/", glob="*.txt"))
    dm = TextDataModule(corpus=HFDatasetCorpus(path="wiki_saved/"))      # needs `pip install datasets`

Modules:

- :mod:`.corpus`: where the text comes from (the embedded corpus, text files, local HF datasets).
- :mod:`.tokenizer`: the :class:`Tokenizer` protocol and the default byte tokenizer.
- :mod:`.cache`: a corpus tokenised once, saved as one ``.npy`` file, memory-mapped afterwards.
- :mod:`.datamodule`: :class:`TextDataModule`, fixed-length next-token blocks with a train/val split.
"""

from lightning_dynmo.data.cache import TokenCache, default_cache_dir
from lightning_dynmo.data.corpus import Corpus, HFDatasetCorpus, StdlibCorpus, TextFileCorpus
from lightning_dynmo.data.datamodule import BlockSplit, TextDataModule, TokenBlocks, split_blocks, tokenize
from lightning_dynmo.data.tokenizer import ByteTokenizer, Tokenizer

__all__ = [
    "BlockSplit",
    "ByteTokenizer",
    "Corpus",
    "HFDatasetCorpus",
    "StdlibCorpus",
    "TextDataModule",
    "TextFileCorpus",
    "TokenBlocks",
    "TokenCache",
    "Tokenizer",
    "default_cache_dir",
    "split_blocks",
    "tokenize",
]
