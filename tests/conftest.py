"""Suite-wide settings: CPU runs use the Triton interpreter and keep thread counts small (CI has 2 cores)."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
os.environ.setdefault("PYTHONPATH", os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
torch.set_num_threads(min(2, torch.get_num_threads()))
