module github.com/polygate/polygate/bindings/go

go 1.22
