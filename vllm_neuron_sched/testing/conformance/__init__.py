"""The device runtime contract as a test suite a port runs on its own
hardware (``test_device_contract.py`` says how)."""
