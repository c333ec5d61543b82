"""The torch models and data that the example scripts and bench_peers.py
train alike: ``mlp`` (a plain MLP on random data), ``gpt`` (a small GPT on
the standard library's sources), ``resnet`` (a ResNet on the digits) and
``digits`` (the digits, split alike on every rank); ``command_line`` maps
their flags to the plain values the models take. Each module imports torch;
this package does not, so ``import spar_comm`` never needs it."""
