"""ServerOptions: the server's own flags (not the engine's), as one validated value."""
import argparse
from dataclasses import dataclass
from typing import Optional


@dataclass
class ServerOptions:
    root_path: str = ""                      # --root-path: the prefix a proxy serves us under
    model_root: Optional[str] = None         # /v1/models `root`: the model as the user named it
    enable_server_load_tracking: bool = False   # --enable-server-load-tracking: GET /load counts
    enable_tokenizer_info_endpoint: bool = False  # --enable-tokenizer-info-endpoint
    return_tokens_as_token_ids: bool = False    # --return-tokens-as-token-ids: "token_id:<id>"
    kv_usage_in_response: bool = False       # --kv-usage-in-response (ours): usage.kv always

    def __post_init__(self):
        self.root_path = (self.root_path or "").rstrip("/")
        if self.root_path and not self.root_path.startswith("/"):
            raise ValueError(f"--root-path: must start with '/', got {self.root_path!r}")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, model_root: Optional[str]) -> "ServerOptions":
        return cls(root_path=args.root_path or "", model_root=model_root,
                   enable_server_load_tracking=args.enable_server_load_tracking,
                   enable_tokenizer_info_endpoint=args.enable_tokenizer_info_endpoint,
                   return_tokens_as_token_ids=args.return_tokens_as_token_ids,
                   kv_usage_in_response=args.kv_usage_in_response)
