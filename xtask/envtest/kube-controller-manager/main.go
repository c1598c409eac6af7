// kube-controller-manager, exactly as k8s.io/kubernetes/cmd/kube-controller-manager builds it:
// the local cluster's Deployments, ReplicaSets, EndpointSlices, ServiceAccount tokens and
// namespace deletion (`cargo xtask cluster`).
package main

import (
	"os"
	_ "time/tzdata"

	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/logs/json/register"
	_ "k8s.io/component-base/metrics/prometheus/clientgo"
	_ "k8s.io/component-base/metrics/prometheus/version"
	"k8s.io/kubernetes/cmd/kube-controller-manager/app"
)

func main() {
	command := app.NewControllerManagerCommand()
	os.Exit(cli.Run(command))
}
