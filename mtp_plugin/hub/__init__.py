"""The Hugging Face Hub: heads fetched alone, without their trunk (``fetch``)."""
