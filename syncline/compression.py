"""The public home of gradient compression: ``syncline.compression.CSC(0.01)`` and friends.

The implementations live in :mod:`syncline.dp.compressors` beside the engine that drives them;
this module only gathers the names a user needs (the compressors, the protocol they follow and
the registry and spec parser behind ``--compression``) under one short import path.

Example:
    >>> from syncline.compression import CSC
    >>> model = DataParallel(net, compression=CSC(0.01, warmup_steps=50))
"""

from syncline.dp.compression import BucketRef, Compressor, NoCompression
from syncline.dp.compressors import BF16, CSC, FP16, PowerSGD, TopK
from syncline.dp.registry import COMPRESSORS, CompressorSpec, build_compressor

__all__ = [
    "BF16",
    "COMPRESSORS",
    "CSC",
    "FP16",
    "BucketRef",
    "Compressor",
    "CompressorSpec",
    "NoCompression",
    "PowerSGD",
    "TopK",
    "build_compressor",
]
