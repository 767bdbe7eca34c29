"""The submitit plugin's launchers with eval.sweep.SweepJobs: a job that stops on an error (its folder
locked by another run) is one line of the sweep, and no job outlives the sweep. `eval.sweep.plan`
points `hydra/launcher=submitit_local` and `submitit_slurm` here. Hydra imports this module in every
run: without the submitit plugin (pip install -e ".[slurm]") it defines nothing."""

from eval.sweep import SweepJobs, submitit_launcher

if submitit_launcher is not None:

    class LocalLauncher(SweepJobs, submitit_launcher.LocalLauncher):
        """`hydra/launcher=submitit_local`: the jobs of a sweep in parallel local processes."""

    class SlurmLauncher(SweepJobs, submitit_launcher.SlurmLauncher):
        """`hydra/launcher=submitit_slurm` (and configs/hydra/launcher/slurm.yaml): the jobs on SLURM."""
