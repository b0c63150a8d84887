"""``python -m ckptd`` runs the same command as the ``ckptd`` script."""

from ckptd.cli import main

if __name__ == "__main__":
    main()
