"""The SMS loop: Algorithm 1 (``sms``), its one phase step (``phase``), what it records (``recorder``), replicas across
processes (``distributed``), the run folder (``run_directory``) and the checks of its inputs before any work
(``checks``). ``from hf_sms import SparseModelSoup, run_sms``."""
