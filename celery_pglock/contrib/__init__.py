"""Optional integrations with other frameworks. The core never imports them."""
