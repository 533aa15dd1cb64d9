"""The Hugging Face Hub: heads fetched alone (``fetch``), and where a head-less checkpoint gets one (``card``)."""
