"""The native paged engine, in rooms that depend downward (pyproject's import contract):
``loading`` (start-up) → ``runtime`` (each step) → ``speculation`` → ``graphs`` →
``models`` → ``linear`` | ``attention``."""
