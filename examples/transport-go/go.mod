module github.com/polygate/polygate/examples/transport-go

go 1.22

require github.com/polygate/polygate/bindings/go v0.0.0

replace github.com/polygate/polygate/bindings/go => ../../bindings/go
