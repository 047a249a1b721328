"""The step algorithm both engines share: check a plan against the sequences, run the
engine's forward, sample, commit (``runner.SequenceRunner.step``)."""
