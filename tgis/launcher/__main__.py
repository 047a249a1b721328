"""`python -m tgis.launcher`, the same as the `text-generation-launcher` console script."""

from tgis.launcher.cli import main

if __name__ == "__main__":
    main()
