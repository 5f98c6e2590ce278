import sys

from .cli import main
from .cli.main import MODULE_PROG

sys.exit(main(prog=MODULE_PROG))
