"""The MuLoCo trainer.

Importing it silences the import-time warnings megatron-core gives about optional kernels this
trainer does not use (Transformer Engine, Apex) and about a default of its own config; every other
warning still shows.
"""
import warnings

warnings.filterwarnings("ignore", message=r"(Transformer Engine and Apex are|Apex is) not installed",
                        category=UserWarning)
warnings.filterwarnings("ignore", message=r"full scope is deprecated", category=UserWarning)
