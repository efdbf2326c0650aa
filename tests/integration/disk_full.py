"""Run `quantkit` on a disk that is full (QUANTKIT_TEST_DISK=full: every safetensors write fails with ENOSPC, streamed or not)
or nearly so (QUANTKIT_TEST_DISK=small: the file system reports 1 kB free), for the bad-input catalogue."""

import errno
import os
import shutil
import sys
from collections import namedtuple

from quantkit.cli.console import quiet_libraries

quiet_libraries()

if os.environ["QUANTKIT_TEST_DISK"] == "small":
    Usage = namedtuple("Usage", "total used free")
    shutil.disk_usage = lambda path: Usage(10**3, 0, 10**3)
else:
    import transformers.modeling_utils

    from quantkit.export import shards

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    transformers.modeling_utils.safe_save_file = no_space  # the in-memory path's writes (save_pretrained)
    shards._Shard.write = no_space  # the streamed path's (each tensor into its shard)

from quantkit.cli.main import main  # noqa: E402

sys.argv = ["quantkit", *sys.argv[1:]]
main()
