import sys

from .cli import main
from .sweep import plot_command

sys.exit(main(plot=plot_command))
