//go:build tools

// Keeps the suite's packages (and so their go.sum lines) in this module's build list.
package haptic

import (
	_ "sigs.k8s.io/gateway-api/conformance"
	_ "sigs.k8s.io/gateway-api/conformance/echo-basic/grpcechoserver"
)
