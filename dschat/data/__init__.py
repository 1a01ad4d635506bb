"""dschat's data pipeline, with DeepSpeed-Chat's interface.

* ``get_raw_dataset(name, output_path, seed, local_rank, **field_options)``: an adapter
  (``PromptRawDataset``) for a hub dataset (exact names in ``HUB_DATASETS``), ``"tiny"``, or local files
  (``jsonl:PATH`` etc.; see ``dschat.data.sources``).
* ``create_prompt_dataset(...)``: tokenized, cached (train, eval) torch datasets for phase 1, 2 or 3.
* ``DataCollatorSFT`` / ``DataCollatorReward`` / ``DataCollatorRLHF``: batch padding per phase
  (``DataCollatorDPO``: phase 2 plus the answer-token mask).
* ``format_prompt`` / ``format_answer`` / ``get_eot_token``: the text format shared by all steps.
* ``get_unsupervised_data``: step 3's PTX data.
"""
from .base import PromptRawDataset
from .cache import FORMAT_VERSION, tokenizer_fingerprint
from .collators import DataCollatorDPO, DataCollatorReward, DataCollatorRLHF, DataCollatorSFT, pad_sequences
from .errors import DatasetFormatError, RecordError, SkipRecord
from .fields import parse_field_map
from .formatting import format_answer, format_prompt, get_eot_token, parse_transcript
from .local import LocalDataset
from .pipeline import PromptDataset, create_prompt_dataset, format_skip_line
from .raw_datasets import (HUB_DATASETS, TINY_NAME, AnthropicHhrlhfDataset, DahoasFullhhrlhfDataset,
                           DahoasRmstaticDataset, DahoasSyntheticinstructgptjpairwiseDataset,
                           OpenaiWebgptcomparisonsDataset, StanfordnlpSHPDataset,
                           YitingxieRlhfrewarddatasetsDataset, get_raw_dataset, known_dataset_names)
from .sources import LocalSource
from .splits import get_raw_dataset_split_index, get_shuffle_idx
from .unsupervised import get_unsupervised_data

__all__ = [
    "PromptRawDataset", "LocalDataset", "LocalSource", "HUB_DATASETS", "TINY_NAME", "get_raw_dataset",
    "known_dataset_names", "parse_field_map", "AnthropicHhrlhfDataset", "DahoasFullhhrlhfDataset",
    "DahoasRmstaticDataset", "DahoasSyntheticinstructgptjpairwiseDataset", "OpenaiWebgptcomparisonsDataset",
    "StanfordnlpSHPDataset", "YitingxieRlhfrewarddatasetsDataset",
    "create_prompt_dataset", "PromptDataset", "format_skip_line", "FORMAT_VERSION", "tokenizer_fingerprint",
    "DataCollatorSFT", "DataCollatorReward", "DataCollatorDPO", "DataCollatorRLHF", "pad_sequences",
    "DatasetFormatError", "RecordError", "SkipRecord",
    "format_prompt", "format_answer", "get_eot_token", "parse_transcript",
    "get_raw_dataset_split_index", "get_shuffle_idx", "get_unsupervised_data",
]
