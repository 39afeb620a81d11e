//! cloud-hypervisor driver (REST API, hybrid vsock).
