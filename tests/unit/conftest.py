"""tests/unit/: unit tests of one module each (ddpkit/, mnist_ddp.py's functions, sweep.py's
summary, benchmarks/figures.py and the pages' claims). They start no process of training;
some start a helper process of their own (a forked holder of a lock, two Gloo ranks, a mount
namespace)."""
