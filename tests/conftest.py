import os
from pathlib import Path

from wildtrain import services

REPO = Path(__file__).resolve().parents[1]

# Every Ray cluster a test starts uses token authentication, as `wildtrain up` does. Ray
# reads the mode once, when it is imported, so it is set before any test module imports it.
os.environ.update(services.token_auth_env())
