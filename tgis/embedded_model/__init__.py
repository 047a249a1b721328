"""The tiny Llama model that ships inside the package and is served when no model is named.

Built, deterministically, by scripts/build_tiny_model.py (see its docstring).
"""

from pathlib import Path

MODEL_DIR = Path(__file__).parent / "data"
