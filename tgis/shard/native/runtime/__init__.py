"""Each step: ``ModelRunner`` and the sequences' state (``model_runner``), the prompt
prefixes' rows in a step (``prefix_rows``), and rank 0 driving the other ranks in lock step
(``lockstep``)."""
