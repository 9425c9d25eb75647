"""The kit's face: every name mnist_ddp.py uses, and the only module of ddpkit it imports
(besides launch.StopSignals, which must catch the stop signals before torch loads). A recipe
of your own needs these names and nothing else from ddpkit/. The kit reads five of the
recipe's options by name (jobs.RECIPE_FIELDS): global_batch, batch_size, epochs, max_steps
and lr; a recipe without one of them stops in one line.

  run_job, Job        the job runner: a process's part of the job, from its options to its exit code
  TrainingRun         what happens around each step and epoch (checkpoints, logs, the agreed stop)
  WeightAverage       an exponential moving average of the weights (--ema), which evaluation scores
  Stopped             raised to end the loop at an agreed stop, with the checkpoint it saved
  UsageError, need    a user's mistake, in one line that says what to do, and the check that raises it
  RunOptions, option  the kit's options, and a field of the recipe's own options
  split_batch         each rank's images a step, or a UsageError that says which world sizes split the batch
  StepParts           the recipe's parts that --check times a training step of
  stage_data, read_splits, ImageSet, normalize
                      the data: staged under a lock, its two splits, uint8 images as the model's input
  whiten_first_layer  a first convolution started as the whitening of the training images' patches
  Examples            the few test images an evaluation shows in TensorBoard
  Runtime, wrap_ddp, all_reduce, sync_buffers
                      this process in the group: the model in DDP, the labelled collectives
  exit_status         a code for sys.exit
"""

from ddpkit.data.imagesets import ImageSet, normalize, read_splits
from ddpkit.data.imagesets import stage as stage_data
from ddpkit.data.whitening import whiten_first_layer
from ddpkit.distributed import Runtime, all_reduce, sync_buffers, wrap_ddp
from ddpkit.jobs import Job, run_job
from ddpkit.launch import Stopped, UsageError, exit_status
from ddpkit.options import RunOptions, need, option
from ddpkit.run.doctor import StepParts
from ddpkit.run.runlog import Examples
from ddpkit.run.training_run import TrainingRun, split_batch
from ddpkit.run.weight_average import WeightAverage

__all__ = ["Examples", "ImageSet", "Job", "RunOptions", "Runtime", "StepParts", "Stopped", "TrainingRun", "UsageError",
           "WeightAverage", "all_reduce", "exit_status", "need", "normalize", "option", "read_splits", "run_job", "split_batch", "stage_data",
           "sync_buffers", "whiten_first_layer", "wrap_ddp"]
