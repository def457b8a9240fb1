"""`specroute picker`: serve's routing behind a gateway, as the Gateway API Inference
Extension's endpoint picker (Envoy's ext_proc over gRPC). `extproc` reads and writes the
protocol's messages, `exchange` runs one request's stream through serve's request path,
`outcomes` turns what the gateway saw of an answer into the request's `Result`, and `picker`
holds the shared state and the gRPC services."""
