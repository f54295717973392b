"""Step 2 of the EAGLE-3 data pipeline: the hidden states of tokenized samples, one file each.

This is ``speccompat extract`` (``speccompat/dataset/extract.py``), with the same flags. Nothing
here is specific to Kimi-K2.5: the same command extracts Llama, Qwen, DeepseekV3 (see ../llama/).
See README.md next to this file and docs/dataset.md.

    python extract_hidden_states.py --model-path /models/Kimi-K2.5 --prepared-data data.jsonl \
        --output-dir hs/ --tp-size 8 --layer-ids 2 30 58 60 --max-seq-len 2048

Exit status: 0 every sample has its file; 1 some samples failed, the engine failed or the disk
filled up (finished files are kept: re-run to resume); 2 refused before any engine started or
anything was written; 130 interrupted.
"""

import sys
from pathlib import Path

if __name__ == "__main__":  # vLLM's spawned workers re-import this file: nothing may run then
    from speccompat.dataset.extract import main

    sys.exit(main(script=Path(__file__).resolve()))
