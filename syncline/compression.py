"""The public home of gradient compression: ``syncline.compression.CSC(0.01)`` and friends.

The implementations live in :mod:`syncline.dp.compressors` beside the engine that drives them;
this module only gathers the names a user needs (the compressors, the protocol they follow and
the spec parser behind ``--compression``) under one short import path.

Example:
    >>> from syncline.compression import CSC
    >>> model = DataParallel(net, compression=CSC(0.01, warmup_steps=50))
"""

from syncline.dp.compression import BucketRef, Compressor, NoCompression
from syncline.dp.compressors import BF16, CSC, FP16, PowerSGD, TopK, build_compressor

__all__ = [
    "BF16",
    "CSC",
    "FP16",
    "BucketRef",
    "Compressor",
    "NoCompression",
    "PowerSGD",
    "TopK",
    "build_compressor",
]
