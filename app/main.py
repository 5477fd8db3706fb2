"""Placeholder until the dashboard lands: lists the shipped demo models."""
import json
from pathlib import Path

import streamlit as st

st.title("FCA: Frozen-Controller Auditing")
for log in sorted(Path(__file__).resolve().parent.parent.glob("cache/demo/*/training_log.json")):
    st.write(f"{log.parent.name}: held-out NLL {json.loads(log.read_text())['final_eval_nll']:.4f} nats/token")
