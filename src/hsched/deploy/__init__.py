"""Deployment descriptions generated from a fleet file (`hsched k8s render`: hsched.deploy.k8s)."""
