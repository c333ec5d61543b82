"""The torch models and data that the example scripts and bench_peers.py
train alike: ``mlp`` (a plain MLP on random data), ``gpt`` (a small GPT on
the standard library's sources) and ``resnet`` (a ResNet on the digits).
Each module imports torch; this package does not, so ``import spar_comm``
never needs it."""
