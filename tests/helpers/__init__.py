"""What the tests share: starting processes, making data, a local Slurm (docs/tests.md)."""
